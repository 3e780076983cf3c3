//go:build tools

// Package hack pins the binaries the harness builds from k8s.io/kubernetes.
//
// It also imports the main module, so that the main module stays in this
// module's build list even before any test imports it: the kube binaries are
// then built with the same dependency versions the tests are linked with, and
// adding the first e2e import does not silently change them.
package hack

import (
	_ "github.com/tokenbroker/tokenbroker/api/v1"
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kubectl"
)
