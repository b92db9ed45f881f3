"""The shared runtime every kernel family uses on the host: device facts (device.py),
argument checks and dtype parsing (checks.py), the packed plan buffer (plan_buffer.py),
CUDA-graph capacity (capacity.py) and page-id buffers (graph_ids.py), split-KV's partial
states and merge counters (split_kv.py), the softmax's logit scale (scales.py), native
planners and launch entries (native.py, fastcall.py), a family's op and the record of a
run()'s launch (launch.py), page tables (page_table.py), the page order (page_order.py)
and the specs the families share (shared_specs.py). It imports the pipeline, never a
family."""
