"""eyas.export"""
