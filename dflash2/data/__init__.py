"""Training data: chats rendered with the target's template (`chat`), random anchors, blocks and their attention
mask (`anchors`), the rows a step draws and each rank's share of them (`sampling`), their batches (`collate`), the
Lightning DataModule (`datamodule`, the only part that needs Lightning), the target's own replies (`regenerate`), more
prompts from packages and generators (`sources`, `generators`), the recipe's data in one command (`recipe`), the
benchmarks' prompts (`benches`) and the cache of the target's features (`features` writes it, `feature_store` reads
it)."""
