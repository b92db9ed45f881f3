"""FlashInfer's module generators, as its tests import them for their warm-up (see
flashinfer/jit/__init__.py of this shim): they describe nothing here."""


def _nothing(*args, **kwargs):
    return None


gen_pod_module = gen_batch_pod_module = gen_batch_decode_module = gen_batch_prefill_module = _nothing
gen_single_decode_module = gen_single_prefill_module = gen_batch_attention_module = _nothing
