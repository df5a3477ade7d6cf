# test_elastic.sh's torch case: prints torchrun's elastic variables as this
# worker sees them, on one line, under torchrun and under ddprun alike; the
# test compares the two launchers' lines. Rank 1 fails while
# TORCHELASTIC_RESTART_COUNT is 0, so the second round's values are
# compared too. Paths and ports differ by launcher: only whether they are
# given (and the error file's name) is printed.
import os
import sys

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
if os.environ.get("RANK") == "1" and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
    sys.exit(3)
