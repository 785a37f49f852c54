"""The learned metrics' trainers: RoViST-C coherence
(:mod:`~storyrl.training.judges.coherence`), Vrank
(:mod:`~storyrl.training.judges.vrank`), COSMiC
(:mod:`~storyrl.training.judges.cosmic`) and RoViST-VG
(:mod:`~storyrl.training.judges.rovist_vg`, its data in
:mod:`~storyrl.training.judges.rovist_vg_data`). Each trains the model a
reward of the same name loads; none imports the storyteller's trainers.
"""
