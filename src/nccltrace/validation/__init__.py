"""Accuracy measurements of the analysis stages against emulator ground truth and the thesis."""
