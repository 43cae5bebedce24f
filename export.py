"""Export a training checkpoint to a servable drafter folder, or check a folder against the contract.

python export.py ckpt_path=runs/my-run output_dir=exports/my-drafter
python export.py check=exports/my-drafter
"""

from dflash2.commands import export

if __name__ == "__main__":
    export.main()
