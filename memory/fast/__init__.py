"""The fast paths of the memory read: what memory/reference.py states plainly,
done the way a training step can afford.

- ops.py: the read `embedding_bag(values, indices, weights)` as a custom op,
  with its kernels (torch, Triton) and the table gradient as rows.
- bag_grad.py: the read's CPU backward, computed by destination slot.
- triton_bag.py: the CUDA read and its gradients in Triton.
- launches.py: how each Triton pass launches (the run's config, measured, or a rule).
- search.py / search_grad.py: the product-key top-k and its custom autograd
  (the gradient touches only the selected sub-keys).
- native_topk.py + topk_rows.c: a C top-k of many short CPU rows.
- exact.py: the lookup's precision rules: its matmuls with TF32 off (custom ops),
  autocast off around it (full_precision).
- row_dots.py: dot products in slot order (PEER's down projection).
- hugepages.py: transparent huge pages for the large, randomly updated tables.

Everything here imports only from this folder, memlm.errors and memlm.files;
the layers (memory/layers.py, memory/product_keys.py, memory/values.py) call in.
Measured speedups are in docs/benchmarks.md.
"""
