"""What counts as bad input: the user's to fix, a missing model or file or an invalid setting, whose message names the
setting as typed and the fix. A command ends on it in that one sentence (dflash2.commands), without a traceback."""

BAD_INPUT = (FileNotFoundError, ValueError)
