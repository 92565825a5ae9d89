"""The serving benchmark's steady-window throughput (bench/serve_load.py)."""

from __future__ import annotations

import pytest

from bench.serve_load import Result, steady_tok_s


def test_steady_throughput_leaves_out_the_drain_after_the_last_request_sent() -> None:
    # two clients: one sends at 0 and at 10, the other at 0; each request makes 100 tokens
    # evenly from its first token (1 s after it was sent) to its end (11 s after it)
    results = [
        Result(1.0, 11.0, 100, None, 0.0),
        Result(1.0, 11.0, 100, None, 0.0),
        Result(1.0, 11.0, 100, None, 10.0),
    ]
    # window 0..10: each of the first two made 90 of its tokens (1..10), the third none yet
    assert steady_tok_s(results) == pytest.approx(180 / 10)


def test_steady_throughput_counts_a_one_event_answer_at_its_end_and_skips_errors() -> None:
    results = [
        Result(2.0, 2.0, 5, None, 0.0),  # every token in one event, at 2 s
        Result(None, 1.0, 0, "HTTP 500", 1.0),
        Result(1.0, 9.0, 80, None, 4.0),  # tokens 5..13, window 0..4: none of them
    ]
    assert steady_tok_s(results) == pytest.approx(5 / 4)


def test_no_window_no_figure() -> None:
    assert steady_tok_s([Result(1.0, 2.0, 10, None, 3.0)]) is None
    assert steady_tok_s([Result(1.0, 2.0, 10, None, 3.0), Result(1.0, 2.0, 10, None, 3.0)]) is None


def test_rows_split_by_kind_of_request() -> None:
    from bench.serve_bench import workload
    from bench.serve_load import body_kind, by_kind, chat_body

    bodies = [chat_body(w) for w in workload(20, 16)]
    kinds = {body_kind(b) for b in bodies}
    assert {"free", "json", "regex", "choice"} <= kinds
    assert {body_kind(chat_body(w)) for w in workload(20, 16, "free")} == {"free"}
    ok = [
        Result(0.1, 1.1, 11, None, 0.0, "free"),  # 0.1 s a token after the first
        Result(0.1, 0.5, 5, None, 0.0, "json"),
        Result(0.1, 0.9, 5, None, 0.0, "json"),  # 0.2 s a token
    ]
    split = by_kind(ok)
    assert split["free"] == {
        "requests": 1,
        "output_tokens": 11,
        "e2e_mean_ms": 1100.0,
        "tpot_p50_ms": 100.0,
    }
    assert split["json"]["requests"] == 2 and split["json"]["e2e_mean_ms"] == 700.0
    assert split["json"]["tpot_p50_ms"] == 200.0  # the upper middle of two


def test_the_eagle_rows_run_on_a_dummy_target_of_the_heads_shape() -> None:
    import argparse

    from bench.serve_bench import head_fits

    def args(model: str, load_format: str = "dummy") -> argparse.Namespace:
        return argparse.Namespace(model=model, load_format=load_format, eagle_head="embedded")

    assert head_fits(args("bench/configs/smollm2-135m"))  # SmolLM2's shape and vocabulary
    assert not head_fits(args("bench/configs/llama-135m"))  # its hidden size, not its vocabulary
    assert not head_fits(args("bench/configs/llama-1b"))
    assert head_fits(args("embedded:smollm2", "auto"))  # real weights: the head's own target


def test_each_serve_bench_mode_pins_the_workers_open_steps_but_default() -> None:
    """A CUDA worker leaves steps open unless told not to: the sync and overlap rows say
    --no-pipeline-steps, the pipelined rows --pipeline-steps, and "default" neither."""
    import argparse

    from bench.serve_bench import worker_cmd

    a = argparse.Namespace(
        model="m", load_format="auto", concurrencies=[1, 8], max_model_len=512, k=4,
        eagle_head="embedded", draft_model=None, compile=False, device=None, dtype=None,
    )  # fmt: skip
    flags = {
        mode: {f for f in worker_cmd(a, "none", mode, "ipc:///x", 0) if "pipeline" in f}
        for mode in ("sync", "overlap", "pipelined", "default")
    }
    assert flags == {
        "sync": {"--no-pipeline-steps"},
        "overlap": {"--no-pipeline-steps"},
        "pipelined": {"--pipeline-steps"},
        "default": set(),
    }


def test_serve_ratios_pair_passes_and_leave_out_a_pass_with_errors() -> None:
    """The k-th row of a drafter at a load against the k-th row without drafts there; a pass
    where either row had errors is left out (and counted), not paired with the next."""
    from bench.serve_ratios import ratios

    def row(drafter: str, load: str, tok_s: float, errors: int = 0) -> dict[str, object]:
        return {
            "path": "served", "drafter": drafter, "mode": "pipelined", "load": load,
            "output_tok_s": tok_s, "output_tokens": tok_s, "wall_s": 1.0, "errors": errors,
        }  # fmt: skip

    rows = [
        row("none", "c=8", 1000.0), row("none", "c=64", 4000.0),
        row("none", "c=8", 800.0, errors=1), row("none", "c=64", 5000.0),
        row("none", "c=8", 2000.0), row("none", "c=64", 6000.0),
        row("ngram", "c=8", 1100.0), row("ngram", "c=64", 3600.0),
        row("ngram", "c=8", 900.0), row("ngram", "c=64", 5000.0),
        row("ngram", "c=8", 2400.0), row("ngram", "c=64", 6600.0),
        {"path": "in-process", "drafter": "ngram", "load": "c=8", "output_tok_s": 1.0},
    ]  # fmt: skip
    by = {e["load"]: e for e in ratios(rows)}
    assert by["c=8"]["passes"] == [1.1, 1.2] and by["c=8"]["left_out"] == 1
    assert by["c=8"]["pooled"] == round(3500 / 3000, 3)
    assert by["c=64"]["passes"] == [0.9, 1.0, 1.1] and by["c=64"]["median"] == 1.0
    # a pass only one side has (a row cut short by a time limit) is left out and counted
    rows.append(row("ngram", "c=64", 7000.0))
    assert {e["load"]: e for e in ratios(rows)}["c=64"]["left_out"] == 1
