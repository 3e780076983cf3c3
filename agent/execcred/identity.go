package execcred

import (
	"fmt"

	"github.com/tokenbroker/tokenbroker/pki"
)

// maxCertFileBytes bounds the client certificate file, a chain of a few
// certificates.
const maxCertFileBytes = 1 << 20

// PeerIdentity returns the SPIFFE ID of the client certificate in certFile
// (the first certificate of the chain), for the cache key: a cluster's
// identity, or a workload's when it is a pod certificate (the kubelet's
// podCertificate volume, whose chain names the cluster CA), so that a
// workload's plugin never shares its cluster's cache. It only reads the
// certificate; the broker client checks the key, and the broker the chain.
func PeerIdentity(certFile string) (string, error) {
	data, err := pki.ReadFileLimit(certFile, maxCertFileBytes)
	if err != nil {
		return "", fmt.Errorf("read the client certificate: %w", err)
	}
	certs, err := pki.ParseCertificatesPEM(data)
	if err != nil {
		return "", fmt.Errorf("the client certificate %s: %w", certFile, err)
	}
	if pki.IsWorkloadCertificate(certs[0]) {
		return certs[0].URIs[0].String(), nil
	}
	id, err := pki.IdentityFromCert(certs[0])
	if err != nil {
		return "", fmt.Errorf("the client certificate %s: %w", certFile, err)
	}
	return id, nil
}
