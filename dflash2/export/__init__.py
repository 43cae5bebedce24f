"""Export: the atomic export of a training checkpoint (`writer`), the check of a folder against the contract
(`check`) and how SGLang and vLLM serve it (`engines`)."""
