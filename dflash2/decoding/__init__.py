"""Speculative decoding: the draft-and-verify loop (`speculative`) and prompt lookup, the training-free proposer
(`lookup`)."""
