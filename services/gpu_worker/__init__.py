"""The worker: the model forward pass behind the scheduler's plan stream."""

from steploop.gpu_worker.cpu_kernels.threads import quiet_openmp_waits

quiet_openmp_waits()     # before anything here imports torch: libgomp reads its wait policy once, when it loads
