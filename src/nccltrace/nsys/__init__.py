"""Nsight Systems SQLite exports: the reader (:mod:`.reader`, :class:`~.reader.NsysExport`), the
writer (:mod:`.writer`, :class:`~.writer.NsysExportWriter`), the NCCL API call linking
(:mod:`.nccl_api`) and the tables' column specs (:mod:`.schema`).

Imports nothing: a module that reads exports does not carry the writer into its code stamp
(and the reverse); import the module you use.
"""
