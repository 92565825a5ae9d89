"""The worker's configuration: one frozen, keyword-only dataclass, validated at start-up."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

from protocol.options import add_log_args, parse_with_config
from protocol.transport import TransportConfig, check_security, validate_address

# Light on purpose: ``worker.daemon`` checks flags with this module before torch and transformers
# are imported.
EMBEDDED_MODEL = "embedded:smollm2"
LOAD_FORMATS = ("auto", "dummy")
DRAFTERS = ("none", "ngram", "draft_model", "parallel", "eagle")


ATTENTION_BACKENDS = ("auto", "triton", "sdpa")


def attention_backend() -> str:
    """``SPECD_ATTENTION_BACKEND`` (vLLM's ``VLLM_ATTENTION_BACKEND``): ``auto`` when unset; any
    other value than ``ATTENTION_BACKENDS`` is a ValueError naming them (read at start-up, before
    torch is imported, so a typo exits 2 at once)."""
    backend = os.environ.get("SPECD_ATTENTION_BACKEND", "auto")
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(
            f"SPECD_ATTENTION_BACKEND must be one of {', '.join(ATTENTION_BACKENDS)}, "
            f"not {backend!r}"
        )
    return backend


FUSED_LAYERS_SETTINGS = ("auto", "off")


def fused_layers_setting() -> str:
    """``SPECD_FUSED_LAYERS``: ``auto`` when unset (fused_layers.py runs Llama-shaped decoders
    with fused kernels), ``off`` (the model's own forward); anything else is a ValueError."""
    setting = os.environ.get("SPECD_FUSED_LAYERS", "auto")
    if setting not in FUSED_LAYERS_SETTINGS:
        raise ValueError(
            f"SPECD_FUSED_LAYERS must be one of {', '.join(FUSED_LAYERS_SETTINGS)}, not {setting!r}"
        )
    return setting


def check_model_spec(spec: str) -> None:
    """Raise ``FileNotFoundError`` naming what is missing when ``spec`` (``embedded:smollm2``, a
    model directory or a .gguf file) cannot name a model here; file checks only."""
    if spec == EMBEDDED_MODEL:
        return
    path = Path(spec)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file {spec} does not exist")
        return
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"{spec} has no config.json: not a transformers model directory"
            )
        return
    raise FileNotFoundError(
        f"model {spec!r} is neither {EMBEDDED_MODEL}, a model directory, nor a .gguf file "
        "(this worker never downloads weights)"
    )


@dataclass(frozen=True, kw_only=True)
class WorkerConfig:
    model: str = EMBEDDED_MODEL
    load_format: str = "auto"
    drafter: str = "ngram"
    draft_model: str | None = None
    num_speculative_tokens: int = 4
    ngram_min: int = 1
    ngram_max: int = 4
    listen: str = "ipc:///tmp/specd-worker.sock"
    device: str | None = None  # None: CUDA when present
    dtype: str | None = None  # None: bf16 on CUDA, float32 on CPU
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    kv_block_size: int = 16
    num_kv_blocks: int = 0  # 0: from kv_cache_memory_gib, else max_num_seqs full-length slots
    kv_cache_memory_gib: float = 0.0  # 0: not set
    batch_invariant: str | None = None  # None: "pad" on CUDA, "off" on CPU
    log_level: str = "INFO"
    log_format: str = "text"
    metrics_port: int = 0  # 0: no Prometheus endpoint; -1: any free port (logged)
    peer_timeout_s: float = 60.0
    curve_secret: str | None = None
    curve_authorized: str | None = None
    parent_pid: int | None = None
    eagle_head: str | None = None
    tensor_parallel_size: int = 1
    tp_rank: int = 0  # set by rank 0 for the ranks it launches
    tp_init: str | None = None  # the rank group's init method, file://PATH (set by rank 0)
    enforce_eager: bool = False
    enable_torch_compile: bool = False
    pipeline_steps: bool | None = None  # None: on for a CUDA worker of one rank, off otherwise
    chain_drafts: bool = False  # with pipeline_steps: prompt lookup's drafting steps left open

    def transport(self) -> TransportConfig:
        return TransportConfig(
            curve_secret_file=self.curve_secret, curve_authorized_dir=self.curve_authorized
        )

    def __post_init__(self) -> None:
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"--load-format must be one of {', '.join(LOAD_FORMATS)}")
        if self.drafter not in DRAFTERS:
            raise ValueError(
                f"--drafter must be one of {', '.join(DRAFTERS)}, got {self.drafter!r}"
            )
        if self.drafter in ("draft_model", "parallel") and not self.draft_model:
            raise ValueError(f"--drafter {self.drafter} needs --draft-model PATH")
        if (self.drafter == "eagle") != (self.eagle_head is not None):
            raise ValueError("--drafter eagle and --eagle-head DIR go together")
        if self.drafter not in ("draft_model", "parallel") and self.draft_model:
            raise ValueError("--draft-model is only used with --drafter draft_model or parallel")
        if not 0 <= self.num_speculative_tokens <= 15:
            raise ValueError("--num-speculative-tokens must be between 0 and 15")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError("n-gram sizes need 1 <= --ngram-min <= --ngram-max")
        if self.max_num_seqs < 1 or self.max_model_len < 2:
            raise ValueError("--max-num-seqs must be >= 1 and --max-model-len >= 2")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                "--max-num-batched-tokens must be >= --max-num-seqs (one token per running request)"
            )
        if not 1 <= self.kv_block_size <= 1024:
            raise ValueError("--kv-block-size must be between 1 and 1024 tokens")
        if self.num_kv_blocks < 0 or self.kv_cache_memory_gib < 0:
            raise ValueError("--num-kv-blocks and --kv-cache-memory must be >= 0 (0: not set)")
        if self.num_kv_blocks and self.kv_cache_memory_gib:
            raise ValueError("give --num-kv-blocks or --kv-cache-memory, not both")
        per_seq = -(-self.max_model_len // self.kv_block_size)
        if 0 < self.num_kv_blocks < per_seq:
            raise ValueError(
                f"--num-kv-blocks {self.num_kv_blocks} cannot hold one request of "
                f"--max-model-len {self.max_model_len} ({per_seq} blocks of "
                f"{self.kv_block_size}): raise it or lower --max-model-len"
            )
        if self.dtype not in (None, "float32", "bfloat16", "float16"):
            raise ValueError("--dtype must be float32, bfloat16 or float16")
        if self.peer_timeout_s <= 0:
            raise ValueError("--peer-timeout must be positive")
        if not -1 <= self.metrics_port < 65536:
            raise ValueError("--metrics-port must be 0 (off), -1 (any free port) or a TCP port")
        if self.log_format not in ("text", "json"):
            raise ValueError("--log-format must be text or json")
        if self.batch_invariant not in (None, "off", "pad", "pad-fp32"):
            raise ValueError("--batch-invariant must be off, pad or pad-fp32")
        if self.device is not None and not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError("--device must be cpu or cuda[:N]")
        if self.tensor_parallel_size < 1 or not 0 <= self.tp_rank < self.tensor_parallel_size:
            raise ValueError("--tensor-parallel-size must be >= 1 (and --tp-rank below it)")
        if self.enable_torch_compile and self.tensor_parallel_size > 1:
            # the row-parallel layers all-reduce inside the layer: not traced or tested compiled
            raise ValueError("--enable-torch-compile does not work with --tensor-parallel-size > 1")
        validate_address(self.listen)
        check_security(self.listen, self.transport(), server=True)


def parse_args(argv: list[str] | None) -> WorkerConfig:
    ap = argparse.ArgumentParser(
        prog="specd-worker",
        description="The specd worker daemon: runs a target model and a drafter and executes the "
        "scheduler's steps over ZeroMQ.",
        epilog="Exit codes: 0 clean shutdown; 1 fatal error while serving; 2 bad configuration; "
        "3 model load failed.",
    )
    d = WorkerConfig()
    ap.add_argument(
        "--config",
        default=None,
        help="a TOML file of these options (keys as flag names, - or _); flags win",
    )
    ap.add_argument(
        "--model",
        default=d.model,
        help=f"target: {EMBEDDED_MODEL}, a transformers directory, or a .gguf file",
    )
    ap.add_argument(
        "--load-format",
        default=d.load_format,
        choices=LOAD_FORMATS,
        help="auto: the model's weights; dummy: seeded random weights for the --model "
        "directory's config.json (no weights files; vLLM's name), in --dtype, for --model "
        "and --draft-model alike; without a tokenizer.json there a byte-level tokenizer "
        "stands in (benchmarks, tests)",
    )
    ap.add_argument("--drafter", default=d.drafter, choices=DRAFTERS, help="how drafts are made")
    ap.add_argument(
        "--draft-model",
        default=None,
        help="draft model (with --drafter draft_model, or parallel: a model trained for "
        "parallel drafting whose config names a mask token)",
    )
    ap.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=d.num_speculative_tokens,
        help="maximum drafts per request per step (requests may ask for fewer)",
    )
    ap.add_argument("--ngram-min", type=int, default=d.ngram_min, help="shortest n-gram to match")
    ap.add_argument("--ngram-max", type=int, default=d.ngram_max, help="longest n-gram to match")
    ap.add_argument("--listen", default=d.listen, help="ipc://PATH or tcp://HOST:PORT to bind")
    ap.add_argument("--device", default=None, help="cpu or cuda[:N] (default: CUDA when present)")
    ap.add_argument("--dtype", default=None, help="float32, bfloat16 or float16")
    ap.add_argument(
        "--max-num-seqs",
        type=int,
        default=d.max_num_seqs,
        help="KV slots: the most requests running at once",
    )
    ap.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=d.max_num_batched_tokens,
        help="the most tokens one step may run (prefill chunks and drafts included); the "
        "scheduler's default token budget, and steps above it are refused",
    )
    ap.add_argument(
        "--max-model-len",
        type=int,
        default=d.max_model_len,
        help="the longest sequence (prompt + output) in tokens",
    )
    ap.add_argument(
        "--kv-block-size",
        type=int,
        default=d.kv_block_size,
        help="tokens per KV cache block (the paged cache's unit of allocation)",
    )
    ap.add_argument(
        "--num-kv-blocks",
        type=int,
        default=d.num_kv_blocks,
        help="KV cache blocks of the target (0: from --kv-cache-memory, else the memory of "
        "--max-num-seqs full --max-model-len sequences); at least one full-length sequence",
    )
    ap.add_argument(
        "--kv-cache-memory",
        type=float,
        default=d.kv_cache_memory_gib,
        help="GiB of the target's KV cache (keys and values, every layer, this rank's heads); "
        "the number of blocks follows from the model's shape (0: not set)",
    )
    ap.add_argument(
        "--batch-invariant",
        default=None,
        choices=("off", "pad", "pad-fp32"),
        help="pad every forward to fixed shapes so drafts never change a token's "
        "arithmetic (default: pad on CUDA, off on CPU where float32 is exact anyway)",
    )
    ap.add_argument(
        "--curve-secret",
        default=None,
        help="this worker's CURVE certificate (.key_secret from `specd keygen`); "
        "required for tcp://",
    )
    ap.add_argument(
        "--curve-authorized",
        default=None,
        help="folder of the public certificates (.key) of schedulers allowed in",
    )
    add_log_args(ap)
    ap.add_argument(
        "--eagle-head",
        default=None,
        help="folder of an EAGLE-style head trained for the target (config.json and "
        "model.safetensors; with --drafter eagle); 'embedded' is the head shipped for the "
        "embedded SmolLM2",
    )
    ap.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="shard the target over this many processes (one per GPU; gloo on CPU); rank 0 "
        "serves the scheduler and launches the others",
    )
    ap.add_argument("--tp-rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--tp-init", default=None, help=argparse.SUPPRESS)
    ap.add_argument(
        "--parent-pid",
        type=int,
        default=None,
        help="stop when this process (the scheduler that launched the worker) is gone; "
        "set by the scheduler when it launches a worker",
    )
    ap.add_argument(
        "--enforce-eager",
        action="store_true",
        help="no CUDA graphs: run decode steps eagerly (as vLLM's flag of that name)",
    )
    ap.add_argument(
        "--enable-torch-compile",
        action="store_true",
        help="torch.compile the decoder layers around attention (fused norm, rotary and MLP "
        "kernels; as SGLang's flag of that name) for decode steps; on CUDA they compile at "
        "start-up while graphs are captured, on the CPU at the first decode steps",
    )
    ap.add_argument(
        "--pipeline-steps",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="leave a step that verifies and proposes no drafts open (its sampled tokens on the "
        "device) and launch the next step (sent ahead by a scheduler with overlap scheduling) "
        "before reading them, so the host prepares step n+1 while the GPU runs step n (vLLM's "
        "async scheduling; default: on with CUDA and one rank, off on the CPU, where the host "
        "runs the kernels itself and an open step only delays its answer)",
    )
    ap.add_argument(
        "--chain-drafts",
        action="store_true",
        help="with --pipeline-steps and --drafter ngram: leave a step that verifies or proposes "
        "drafts open too, when every request in it is a greedy, unconstrained decode: it "
        "verifies, places the accepted tokens and proposes the next drafts on the device, and "
        "the step behind it is launched before its accepted counts reach the host (vLLM's async "
        "scheduling with speculative decoding); other steps run as before",
    )
    ap.add_argument(
        "--metrics-port",
        type=int,
        default=d.metrics_port,
        help="serve Prometheus metrics on this port (0: off; -1: any free port, logged)",
    )
    ap.add_argument(
        "--peer-timeout",
        type=float,
        default=d.peer_timeout_s,
        help="seconds of silence from a scheduler holding requests before they are "
        "freed (the scheduler is taken for dead)",
    )
    a = parse_with_config(ap, argv)
    attention_backend()  # its value is checked here; worker/paged_kernel.py acts on it
    fused_layers_setting()  # checked here; worker/fused_layers.py acts on it
    return WorkerConfig(
        model=a.model,
        load_format=a.load_format,
        drafter=a.drafter,
        draft_model=a.draft_model,
        num_speculative_tokens=a.num_speculative_tokens,
        ngram_min=a.ngram_min,
        ngram_max=a.ngram_max,
        listen=a.listen,
        device=a.device,
        dtype=a.dtype,
        max_num_seqs=a.max_num_seqs,
        max_num_batched_tokens=a.max_num_batched_tokens,
        max_model_len=a.max_model_len,
        kv_block_size=a.kv_block_size,
        num_kv_blocks=a.num_kv_blocks,
        kv_cache_memory_gib=a.kv_cache_memory,
        batch_invariant=a.batch_invariant,
        log_level=a.log_level,
        log_format=a.log_format,
        metrics_port=a.metrics_port,
        peer_timeout_s=a.peer_timeout,
        curve_secret=a.curve_secret,
        curve_authorized=a.curve_authorized,
        parent_pid=a.parent_pid,
        eagle_head=a.eagle_head,
        tensor_parallel_size=a.tensor_parallel_size,
        tp_rank=a.tp_rank,
        tp_init=a.tp_init,
        enforce_eager=a.enforce_eager,
        pipeline_steps=a.pipeline_steps,
        chain_drafts=a.chain_drafts,
        enable_torch_compile=a.enable_torch_compile,
    )
