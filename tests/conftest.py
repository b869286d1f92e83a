import os

# Multi-process tests share 2 cores: one thread per rank keeps them from oversubscribing.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_report_header(config):
    """Capabilities that choose some tests' assertions (measured, never assumed), shown at the top of every run."""
    from paratrain.train.precision import cpu_has_native_fp16

    return [f"cpu native fp16 (oneDNN: AVX512-FP16 or AMX-FP16): {'yes' if cpu_has_native_fp16() else 'no'}"]
