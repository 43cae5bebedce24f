"""Measure a drafter's acceptance by real speculative decoding (see configs/evaluate.yaml).

python evaluate.py drafter=exports/my-drafter bench=gsm8k bench.limit=20 temperature=0
python evaluate.py -m drafter=exports/my-drafter bench=gsm8k,mtbench temperature=0,1 block_size=8,16
python evaluate.py -m drafter=exports/my-drafter,pld bench=gsm8k,mtbench temperature=0   (pld: prompt lookup)
python evaluate.py -m drafter=exports/my-drafter hybrid=null,ngram bench=gsm8k temperature=0   (lookup beside it)
"""

from dflash2.commands.evaluate import main

if __name__ == "__main__":
    main()
