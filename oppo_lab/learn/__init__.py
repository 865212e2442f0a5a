"""Building the learn task's assets from scratch (`builder`: data, tokenizer, SFT and reward model by
OpenRLHF's own trainers, `trainers`; the build's measurements, `summary`) and shipping a build into the
package (`ship`). The product installs shipped builds only (`openrlhf_oppo.tasks.learn.shipped`)."""
