"""The NVFP4 names FlashInfer's test files import: NVFP4 is not in flashinfer_jit (the runner
leaves those cases out)."""


def e2m1_and_ufp8sf_scale_to_float(*args, **kwargs):
    raise NotImplementedError("NVFP4 is not supported by flashinfer_jit")
