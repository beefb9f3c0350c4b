"""The data pipeline: task selection and mixing, reward shaping, experience filters."""
