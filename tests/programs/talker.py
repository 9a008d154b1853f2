"""A program that only prints (no metrics record, no framework): `talker.py SECONDS` prints a line
every 0.2 s for that long, then exits 0."""
import sys
import time

end = time.time() + float(sys.argv[1])
i = 0
while time.time() < end:
    print(f"loading shard {i}", flush=True)
    i += 1
    time.sleep(0.2)
