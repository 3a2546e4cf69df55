"""Measurement tools the tests and the benchmarks share: a stand-in accelerator on CPU (``fake_device``:
device bugs CUDA would show fail on CPU too; collectives checked for their tensors' device), device→host reads
and host→device copies counted under it (``host_reads``, ``host_writes``), live tensor bytes and their peak
(``live_bytes``), and one DSA layer's core peak at full width on the meta device (``dsa_peak``, the planner's
DSA line)."""
