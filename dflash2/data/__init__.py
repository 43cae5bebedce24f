"""Training data: chats rendered with the target's template (`chat`), random anchors, blocks and their attention
mask (`anchors`), the Lightning DataModule (`datamodule`, the only part that needs Lightning), the target's own
replies (`regenerate`) and more prompts from packages (`sources`)."""
