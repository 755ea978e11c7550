"""The workspace's test processes share this machine's cores (`uv run pytest`, the README's
command): one OpenMP thread per process and waiting threads that sleep, as `.ci/run` sets,
unless the caller set them. Set here, before any test module imports torch (which reads
them at import), so that the pytest process and every worker, rank and interpreter the tests
start inherit them. On a 2-core machine, two training processes at once with torch's default
(2 threads each, libgomp spinning) took 80 s of CPU each against 23 s with these."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
