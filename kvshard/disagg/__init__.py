"""Disaggregated prefill and decode: KV moved between instances of any DCP layouts (docs/disaggregation.md)."""
