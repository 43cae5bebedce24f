"""How much faster a drafter makes its target, predicted and measured: `python speed.py drafter=<export> bench=gsm8k`
(see configs/speed.yaml)."""

from dflash2.commands.speed import main

if __name__ == "__main__":
    main()
