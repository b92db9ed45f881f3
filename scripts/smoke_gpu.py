"""Smallest end-to-end GPU check: build, load and run append + batch indices once,
on a non-default stream, against a direct PyTorch computation. Prints PASS/FAIL."""

import sys
import time

import torch

import flashinfer_jit as fij


def main() -> int:
    torch.manual_seed(0)
    dev = "cuda"
    page, heads, dim, pages = 16, 8, 128, 64
    append_len = torch.tensor([5, 0, 17, 33], dtype=torch.int32)
    seq_lens = append_len + torch.tensor([3, 4, 0, 20], dtype=torch.int32)
    append_indptr = torch.zeros(5, dtype=torch.int32)
    append_indptr[1:] = torch.cumsum(append_len, 0)
    nnz = int(append_indptr[-1]) + 7  # 7 padding tokens
    pages_per = (seq_lens + page - 1) // page
    kv_indptr = torch.zeros(5, dtype=torch.int32)
    kv_indptr[1:] = torch.cumsum(pages_per, 0)
    kv_indices = torch.randperm(pages, dtype=torch.int32)[: int(kv_indptr[-1])]
    last = torch.where(pages_per > 0, seq_lens - (pages_per - 1) * page, 0).to(torch.int32)
    k_cache = torch.randn(pages, page, heads, dim, dtype=torch.bfloat16, device=dev)
    v_cache = torch.randn_like(k_cache)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    key = torch.randn(nnz, heads, dim, dtype=torch.bfloat16, device=dev)
    value = torch.randn_like(key)
    stream = torch.cuda.Stream()
    t0 = time.perf_counter()
    with torch.cuda.stream(stream):
        bi, pos = fij.get_batch_indices_positions(append_indptr.to(dev), seq_lens.to(dev), nnz)
        fij.append_paged_kv_cache(key, value, bi, pos, (k_cache, v_cache), kv_indices.to(dev),
                                  kv_indptr.to(dev), last.to(dev))
    torch.cuda.synchronize()
    print(f"first call (build+load+run): {time.perf_counter() - t0:.1f} s")
    bi_c, pos_c = bi.cpu(), pos.cpu()
    ok = True
    for t in range(nnz):
        b = int(bi_c[t])
        if t >= int(append_indptr[-1]):
            ok &= b == -1 and int(pos_c[t]) == 0
            continue
        p = int(pos_c[t])
        page_id = int(kv_indices[int(kv_indptr[b]) + p // page])
        k_ref[page_id, p % page] = key[t]
        v_ref[page_id, p % page] = value[t]
    ok &= torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
