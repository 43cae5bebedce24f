"""The frozen target: the model and the layers it captures (`model`), where its files come from (`locate`),
grouped-query SDPA for its decode steps (`attention`), its chat template (`chat_template`) and the manifest that
binds a drafter to it (`manifest`)."""
