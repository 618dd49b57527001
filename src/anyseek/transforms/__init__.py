"""Model transforms: applied to a built DeepSeekV3 from outside for training, undone for export."""
