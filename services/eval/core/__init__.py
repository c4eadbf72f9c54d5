"""The eval's pure core: records, bootstrap intervals, pairing, the item loop and the model port."""
