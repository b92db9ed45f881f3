"""The names tests/test_helpers/utils_fp4.py imports; NVFP4 is not in flashinfer_jit."""

nvfp4_e4m3_max = 448.0


class NVFP44Over6Config:
    def __init__(self, *args, **kwargs):
        raise NotImplementedError("NVFP4 is not supported by flashinfer_jit")


class NVFP44Over6ErrMode:
    pass
