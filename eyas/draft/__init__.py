"""eyas.draft"""
