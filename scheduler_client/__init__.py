"""specd's CPU side: scheduler, grammar, worker client, Python API and CLI. Never imports torch."""
