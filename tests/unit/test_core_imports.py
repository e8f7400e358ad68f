import subprocess
import sys


def test_scheduler_core_imports_neither_torch_nor_grpc():
    code = ("import sys, scheduler_svc.core, scheduler_svc.core.scheduler, scheduler_svc.fake_worker; "
            "print(sorted(m for m in ('torch', 'grpc') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
