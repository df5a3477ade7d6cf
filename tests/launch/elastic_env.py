# test_elastic.sh's torch case: prints torchrun's elastic variables as this
# worker sees them, on one line, under torchrun and under ddprun alike; the
# test compares the two launchers' lines. Rank 1 fails while
# TORCHELASTIC_RESTART_COUNT is 0, so the second round's values are
# compared too. Paths and ports differ by launcher: only whether they are
# given (and the error file's name) is printed.
import os
import sys
import time

names = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
         "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "TORCHELASTIC_RESTART_COUNT",
         "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID"]
vals = [f"{n}={os.environ.get(n, '<unset>')}" for n in names]
ef = os.environ.get("TORCHELASTIC_ERROR_FILE")
vals.append("TORCHELASTIC_ERROR_FILE=" + (os.path.basename(ef) if ef else "<unset>"))
vals.append("MASTER_ADDR=" + ("set" if os.environ.get("MASTER_ADDR") else "<unset>"))
vals.append("MASTER_PORT=" + ("set" if os.environ.get("MASTER_PORT", "").isdigit() else "<unset>"))
# One write per line: under python -u, print writes the text and its newline
# apart, and two workers sharing torchrun's stdout can interleave them.
os.write(1, ("env " + " ".join(vals) + "\n").encode())
# Rank 1's failure waits for rank 0's line (a file in $ELASTIC_ENV_DIR), or
# the launcher could stop rank 0 before it printed: a race, not a difference.
mark = os.path.join(os.environ.get("ELASTIC_ENV_DIR", "."), "printed.%s.%s" % (
    os.environ.get("RANK"), os.environ.get("TORCHELASTIC_RESTART_COUNT")))
open(mark, "w").close()
if os.environ.get("RANK") == "1" and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
    rank0 = os.path.join(os.environ.get("ELASTIC_ENV_DIR", "."), "printed.0.0")
    deadline = time.time() + 60
    while not os.path.exists(rank0) and time.time() < deadline:
        time.sleep(0.05)
    sys.exit(3)
