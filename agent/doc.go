// Package agent runs in a source cluster: it enrolls the cluster with a
// broker using a join token, keeps its client certificate renewed, and
// (see the refresher) keeps kubeconfigs from the brokers fresh where their
// consumers read them.
package agent
