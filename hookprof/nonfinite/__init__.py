"""nonfinite"""
