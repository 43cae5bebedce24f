"""The drafter as engines load it: the contract's rules (`contract`), config.json's fields (`config`), the drafter
itself (`drafter`), the grouped convolution (`conv`), the candidate selector (`selector`) and their kernels
(`kernels`)."""
