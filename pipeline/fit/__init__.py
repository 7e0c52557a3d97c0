"""Stage 2, fit: the one pass over the rows and the state it leaves.

columns.py (what a column is and how its values become numbers or text) and transforms.py (the ops:
numeric scaling, clipping, log1p, hashing) are shared with the read stage; stats.py gathers a batch's
partial statistics; counts.py is the count shuffle (map, reduce, finalize; or all of it in one
process); vocab.py the lookups (64-bit hashes, the hash index, hash ranges) and the vocabulary file;
vocab_parts.py the partitioned vocabulary the shuffle leaves; fitted.py and apply.py the fitted state
and its transform; fitted_io.py its JSON; history.py every value's count, kept for the next increment;
preprocess.py the public FittedPreprocessor.
"""
