"""A fake training rank for py-spy captures: rank 3 blocks in data loading."""
import os, sys, threading, time

DEADLINE = time.time() + 60


def heartbeat():
    while time.time() < DEADLINE:
        time.sleep(0.2)


def wait_in_collective():
    print(os.getpid(), flush=True)
    while time.time() < DEADLINE:
        time.sleep(0.05)


def load_batch():
    print(os.getpid(), flush=True)
    while time.time() < DEADLINE:
        time.sleep(0.05)


def train_step(slow):
    if slow:
        load_batch()
    else:
        wait_in_collective()


def main():
    rank, slow_rank = int(sys.argv[1]), int(sys.argv[2])
    threading.Thread(target=heartbeat, name="tg-heartbeat", daemon=True).start()
    train_step(rank == slow_rank)


if __name__ == "__main__":
    main()
