"""The KV-cache family: writes into the paged cache and reads out of it, with no attention.

append.py (append_paged_kv_cache, get_batch_indices_positions, get_seq_lens;
FlashInfer's `flashinfer.page`), rope.py (RoPE, and RoPE + fp8 quantize + append;
`flashinfer.rope`), flatten.py (paged to contiguous); each with its spec beside it
(append_spec.py, flatten_spec.py) but RoPE's, which the Hopper prefill path's RoPE pass runs
too: runtime/shared_specs.py."""
