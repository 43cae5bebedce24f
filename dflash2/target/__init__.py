"""The frozen target: the model and the layers it captures (`model`), where its files come from (`locate`),
grouped-query SDPA for its decode steps (`attention`), its chat template (`chat_template`), the manifest that binds a
drafter to it (`manifest`) and what a drafter inherits from it: config fields, head, mask token (`inherited`)."""
