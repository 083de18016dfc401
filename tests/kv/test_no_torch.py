import subprocess
import sys


def test_kv_package_and_scheduler_import_without_torch():
    code = ("import sys; import pagedkv.kv, pagedkv.kv.manager, pagedkv.sched.scheduler; "
            "import pagedkv.commands.plan; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
