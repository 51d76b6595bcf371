"""Turning what a training run leaves behind (Nsight Systems reports, launch settings) into the
inputs the analysis reads. Import the submodules directly (e.g. ``nccltrace.acquisition.nsys_export``)."""
