"""The build pipeline: a spec (spec.py) is rendered into sources (render.py), keyed and
published in the on-disk cache (cache.py), built with nvcc and ninja (build.py,
toolchain.py) and loaded as torch ops (jit.py); matrix.py and pack.py serve the AOT
command. It knows no kernel family: families build on it."""

__version__ = "0.1.0"
