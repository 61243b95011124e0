"""efficiency"""
