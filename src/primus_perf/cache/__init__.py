"""The tuning cache: keys, storage, validation, merge, import/export."""
