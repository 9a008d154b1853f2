"""What the tests share: real sshd nodes (sshd.py), a deployed job on them (ssh_job.py), a job on local
nodes (local_job.py), /proc scans (procscan.py), synthetic dashboard jobs (synthetic.py), a webhook
receiver (webhook.py). The programs the tests run as jobs are in tests/programs/."""
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
