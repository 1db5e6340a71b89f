"""Speculative decoding: proposers of draft tokens, and the rejection sampler that verifies them."""
