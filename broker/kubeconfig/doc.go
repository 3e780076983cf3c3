// Package kubeconfig writes the kubeconfigs the broker answers with: Build
// for a credential (a token, or a client certificate and key, as clientcmd's
// AuthInfo carries them), written directly rather than through a YAML
// encoder and checked against clientcmd and golden files, and Exec for one
// that runs the exec credential plugin against the broker. Every value it
// writes comes from a validated policy or request; it quotes what YAML
// could misread.
package kubeconfig
