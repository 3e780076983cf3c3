package kubeconfig

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"fmt"

	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"

	"github.com/tokenbroker/tokenbroker/broker/policy"
	"github.com/tokenbroker/tokenbroker/issuers"
	"k8s.io/client-go/tools/clientcmd"
)

// Build returns a complete kubeconfig for subject (the
// ServiceAccount of a token, the per-lease user of a certificate):
// the cluster's external URL and CA bundle (and its tls-server-name and
// proxy-url when the policy sets them), the credential as clientcmd's
// AuthInfo carries it (token, or client-certificate-data and
// client-key-data), and a current context in the ServiceAccount's
// namespace, so that kubectl works with it as is.
//
// It writes the YAML directly: the shape is fixed, and going through
// sigs.k8s.io/yaml (JSON, then a YAML parse and emit) was a sixth of the
// broker's CPU per issuance in make bench's profile. Every string is
// written as a JSON string, which is a valid YAML double-quoted scalar
// (writeQuoted), so no value can break the document or change on the way;
// TestKubeconfigMatchesClientcmd checks the result against client-go's own
// types.
func Build(cluster policy.ClusterSpec, namespace, subject string, cred issuers.Credential) ([]byte, error) {
	user := subject + "@" + cluster.Name
	ctxName := namespace + "/" + subject + "@" + cluster.Name
	var b bytes.Buffer
	b.Grow(512 + len(cred.Token) + base64.StdEncoding.EncodedLen(len(cred.CertificatePEM)+len(cred.KeyPEM)) + len(cluster.TLSServerName) + len(cluster.ProxyURL) + base64.StdEncoding.EncodedLen(len(cluster.CAData)))
	b.WriteString("apiVersion: v1\nkind: Config\nclusters:\n- name: ")
	writeQuoted(&b, cluster.Name)
	b.WriteString("\n  cluster:\n    server: ")
	writeQuoted(&b, cluster.Server)
	if cluster.TLSServerName != "" {
		b.WriteString("\n    tls-server-name: ")
		writeQuoted(&b, cluster.TLSServerName)
	}
	if cluster.ProxyURL != "" {
		b.WriteString("\n    proxy-url: ")
		writeQuoted(&b, cluster.ProxyURL)
	}
	b.WriteString("\n    certificate-authority-data: ")
	b.WriteString(base64.StdEncoding.EncodeToString([]byte(cluster.CAData)))
	b.WriteString("\nusers:\n- name: ")
	writeQuoted(&b, user)
	b.WriteString("\n  user:")
	switch cred.Kind() {
	case issuers.KindClientCertificate:
		b.WriteString("\n    client-certificate-data: ")
		b.WriteString(base64.StdEncoding.EncodeToString(cred.CertificatePEM))
		// Without a key when the caller made the CSR: it adds its own
		// (kubectl config set-credentials --client-key).
		if len(cred.KeyPEM) > 0 {
			b.WriteString("\n    client-key-data: ")
			b.WriteString(base64.StdEncoding.EncodeToString(cred.KeyPEM))
		}
	default:
		b.WriteString("\n    token: ")
		writeQuoted(&b, cred.Token)
	}
	b.WriteString("\ncontexts:\n- name: ")
	writeQuoted(&b, ctxName)
	b.WriteString("\n  context:\n    cluster: ")
	writeQuoted(&b, cluster.Name)
	b.WriteString("\n    user: ")
	writeQuoted(&b, user)
	b.WriteString("\n    namespace: ")
	writeQuoted(&b, namespace)
	b.WriteString("\ncurrent-context: ")
	writeQuoted(&b, ctxName)
	b.WriteString("\n")
	return b.Bytes(), nil
}

// writeQuoted writes s as a JSON string, which YAML reads as a
// double-quoted scalar with the same value once the characters JSON leaves
// raw but YAML reads otherwise are escaped too: DEL, the C1 controls
// (U+0085 NEL is a line break to YAML, folded to a space; the rest are
// refused) and the noncharacters U+FFFE and U+FFFF (refused).
func writeQuoted(b *bytes.Buffer, s string) {
	q, _ := json.Marshal(s) // a string always marshals, as valid UTF-8
	// Every rune yamlMisreads names starts with one of these bytes in
	// UTF-8 (DEL; C2 for U+0080..U+009F; EF for U+FFFE, U+FFFF): three
	// vectorised byte searches keep the common case as fast as before.
	if bytes.IndexByte(q, 0x7f) < 0 && bytes.IndexByte(q, 0xc2) < 0 && bytes.IndexByte(q, 0xef) < 0 {
		b.Write(q)
		return
	}
	const hex = "0123456789abcdef"
	for _, r := range string(q) {
		if !yamlMisreads(r) {
			b.WriteRune(r)
			continue
		}
		// \uXXXX by hand: fmt would make b escape to the heap, an
		// allocation on every issuance.
		b.WriteString(`\u`)
		for shift := 12; shift >= 0; shift -= 4 {
			b.WriteByte(hex[r>>shift&0xf])
		}
	}
}

// yamlMisreads reports whether YAML reads r, written raw in a
// double-quoted scalar, as anything but r. Every such rune is in the
// Basic Multilingual Plane, so \uXXXX escapes it in JSON and YAML alike.
func yamlMisreads(r rune) bool {
	return r >= 0x7f && r <= 0x9f || r == 0xfffe || r == 0xffff
}

// Exec is the kubeconfig of an exec request, named like the ones
// with a credential: the user <serviceAccount>@<cluster> (for a client
// certificate, whose user is new at every lease, client-certificate@<cluster>)
// and the context <namespace>/<user>.
func Exec(cluster policy.ClusterSpec, req apiv1.KubeconfigRequest, brokerURL string) ([]byte, error) {
	subject := req.ServiceAccount
	if req.Credential == apiv1.CredentialClientCertificate {
		subject = "client-certificate"
	}
	user := subject + "@" + cluster.Name
	ctxName := req.Namespace + "/" + user
	cfg := clientcmdapi.NewConfig()
	cfg.Clusters[cluster.Name] = &clientcmdapi.Cluster{
		Server:                   cluster.Server,
		TLSServerName:            cluster.TLSServerName,
		ProxyURL:                 cluster.ProxyURL,
		CertificateAuthorityData: []byte(cluster.CAData),
	}
	cfg.AuthInfos[user] = &clientcmdapi.AuthInfo{Exec: &clientcmdapi.ExecConfig{
		APIVersion:      "client.authentication.k8s.io/v1",
		Command:         "tokenbroker",
		Args:            apiv1.PluginArgs(brokerURL, "", req),
		InstallHint:     pluginInstallHint,
		InteractiveMode: clientcmdapi.NeverExecInteractiveMode,
	}}
	cfg.Contexts[ctxName] = &clientcmdapi.Context{Cluster: cluster.Name, AuthInfo: user, Namespace: req.Namespace}
	cfg.CurrentContext = ctxName
	kc, err := clientcmd.Write(*cfg)
	if err != nil {
		return nil, fmt.Errorf("write exec kubeconfig: %w", err)
	}
	return kc, nil
}

// pluginInstallHint is what client-go prints when the exec kubeconfig's
// command is not on the PATH.
const pluginInstallHint = `This kubeconfig runs "tokenbroker credential", the exec credential plugin of
the tokenbroker binary: put tokenbroker on your PATH, and set
TOKENBROKER_IDENTITY_DIR to your identity directory (tls.crt, tls.key, ca.crt).`
