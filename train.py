"""Train a DFlash2 drafter: `python train.py [group=option ...] [key=value ...]` (see configs/train.yaml)."""

from dflash2.commands import train

if __name__ == "__main__":
    train.main()
