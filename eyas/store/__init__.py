"""eyas.store"""
