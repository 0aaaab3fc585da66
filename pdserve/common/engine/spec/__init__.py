"""Speculative decoding on the decode side (docs/speculative.md): proposers of draft
tokens (`ngram`: prompt lookup; `draft_model`: another model, or the target in another
precision), the policy deciding how many to propose (`policy`), the rejection sampler
that verifies them against the target in one step (`verify`), and the `Speculator` the
engine drives each step. Modules are imported by name: the runner imports `verify`, and
`draft_model` imports the runner."""
