"""FlashInfer's quantization package as its test helpers import it: NVFP4 is not in
flashinfer_jit, and the runner leaves the NVFP4 cases out."""
